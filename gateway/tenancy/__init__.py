"""Tenancy: SLA-tier admission control, rate limits (RPM/TPM, optionally shared through
Redis) and the admin API's schemas for tiers, tenants and keys."""
