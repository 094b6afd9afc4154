// Admin API client: every call sends the admin token (kept in sessionStorage) as a
// Bearer token. Errors carry the gateway's OpenAI-style message.

const TOKEN_KEY = "sparkgate.adminToken";

export function getToken(): string | null {
  return sessionStorage.getItem(TOKEN_KEY);
}

// Bumped at every sign-in and sign-out: an answer to a request sent before it (a page that
// was already left) can no longer sign the current session out.
let authEpoch = 0;

export function setToken(token: string): void {
  sessionStorage.setItem(TOKEN_KEY, token);
  authEpoch++;
}

export function clearToken(): void {
  sessionStorage.removeItem(TOKEN_KEY);
  authEpoch++;
}

export class ApiError extends Error {
  constructor(
    public status: number,
    message: string,
    public code: string | null = null,
    public param: string | null = null,
  ) {
    super(message);
  }
}

/** What a 401/403 means to a person signing in to the admin UI. */
export function authMessage(status: number): string {
  if (status === 403) {
    return "This is a tenant API key. The admin UI and the admin API only accept the admin token (SPARKGATE_ADMIN_TOKEN).";
  }
  return "The gateway did not accept this token: it is unknown, revoked or expired.";
}

type Listener = (status: number) => void;
let onAuthError: Listener = () => {};
export function setAuthErrorHandler(fn: Listener): void {
  onAuthError = fn;
}

export async function request<T>(
  method: string,
  path: string,
  body?: unknown,
  token: string | null = getToken(),
): Promise<T> {
  const epoch = authEpoch;
  const headers: Record<string, string> = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let res: Response;
  try {
    res = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
      credentials: "omit",
    });
  } catch {
    throw new ApiError(0, "Cannot reach the gateway. Is it running?");
  }
  if (res.status === 204) return undefined as T;
  let data: any = null;
  try {
    data = await res.json();
  } catch {
    data = null;
  }
  if (!res.ok) {
    const err = data?.error ?? {};
    const message = typeof err.message === "string" ? err.message : `HTTP ${res.status}`;
    const e = new ApiError(res.status, message, err.code ?? null, err.param ?? null);
    // Only a refusal of the token now in use signs out (not a late answer to an older or absent one).
    const current = token !== null && token === getToken() && epoch === authEpoch;
    if ((res.status === 401 || res.status === 403) && current) onAuthError(res.status);
    throw e;
  }
  return data as T;
}

export const get = <T>(path: string, params: Record<string, string | number | null | undefined> = {}) => {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined && v !== "") q.set(k, String(v));
  const qs = q.toString();
  return request<T>("GET", qs ? `${path}?${qs}` : path);
};
export const post = <T>(path: string, body?: unknown) => request<T>("POST", path, body ?? {});
export const patch = <T>(path: string, body: unknown) => request<T>("PATCH", path, body);

// ---------------------------------------------------------------- API shapes
export interface Tier {
  name: string;
  min_tokens_per_s: number | null;
  max_concurrent: number | null;
  rpm: number | null;
  tpm: number | null;
  priority: number;
  max_queue_wait_s: number;
  created_at: string;
}
export interface Tenant {
  name: string;
  tier: string | null;
  effective_tier: string;
  created_at: string;
}
export interface Key {
  id: number;
  prefix: string;
  tenant: string;
  user: string | null;
  status: string;
  created_at: string;
  last_used_at: string | null;
  expires_at: string | null;
  revoked_at: string | null;
  token_budget: number | null;
  tokens_used: number;
  rpm_limit: number | null;
  tpm_limit: number | null;
}
export interface KeyCreated extends Key {
  key: string;
}
export interface Record_ {
  id: string;
  tenant: string;
  key_id: number | null;
  user: string | null;
  tier: string | null;
  model: string;
  endpoint: string;
  stream: boolean;
  status: string;
  finish_reason: string | null;
  error_code: string | null;
  error_message: string | null;
  queued_at: string;
  started_at: string | null;
  first_token_at: string | null;
  finished_at: string;
  prompt_tokens: number;
  completion_tokens: number;
  max_tokens: number;
  ttft_s: number | null;
  admission_wait_s: number | null;
  decode_tokens_per_s: number | null;
  predicted_tokens_per_s: number | null;
  spec_rounds: number | null;
  spec_drafted: number | null;
  spec_verified: number | null;
  spec_accepted: number | null;
  spec_emitted: number | null;
  spec_tau: number | null;
  accepted_per_position: number[] | null;
  sla_target_tokens_per_s: number | null;
  sla_met: boolean | null;
  constraint: "json_object" | "json_schema" | "tools" | null;
  mask_ms_per_token: number | null;
}
export interface RecordPage {
  data: Record_[];
  has_more: boolean;
  next_cursor: string | null;
}
export interface SeriesPoint {
  minute: string;
  tokens_per_s: number | null;
  requests: number;
  completion_tokens: number;
}
export interface UserSeries {
  tenant: string;
  user: string | null;
  points: SeriesPoint[];
}
export interface UserSummary {
  tenant: string;
  user: string | null;
  tier: string | null;
  requests: number;
  finished: number;
  failed: number;
  cancelled: number;
  rejected: number;
  prompt_tokens: number;
  completion_tokens: number;
  tokens_per_s_p50: number | null;
  sla_requests: number;
  sla_met: number;
  sla_attainment: number | null;
  last_minute: string;
}
export interface Acceptance {
  tenant?: string | null;
  model?: string | null;
  tier?: string | null;
  rounds: number;
  drafted: number;
  accepted: number;
  emitted: number;
  acceptance_rate: number | null;
  tau: number | null;
  per_position: number[];
  constrained: SpecSplit;
  plain: SpecSplit;
}
/** Speculation of grammar-constrained (JSON, tools) or of free-text requests. */
export interface SpecSplit {
  rounds: number;
  drafted: number;
  accepted: number;
  emitted: number;
  acceptance_rate: number | null;
  tau: number | null;
}
export interface SlaRow {
  tier: string | null;
  requests: number;
  graded_requests: number;
  met_requests: number;
  attainment: number | null;
  user_minutes: number;
  user_minutes_met: number;
  user_minute_attainment: number | null;
  rejected: number;
}
export interface Engine {
  ready: boolean;
  running: number;
  waiting: number;
  max_batch: number;
  forward_steps: number;
  decode_steps: number;
  verify_tokens: number;
  decode_rows: number;
  zero_budget_rows: number;
  decode_tokens: number;
  spec: {
    method: string;
    policy: string | null;
    block_size: number;
    sps_table: { buckets: number[]; context_lens: number[]; sps: number[][]; note?: string } | null;
  };
}
export interface TenancyStatus {
  records: { buffered: number; written: number; dropped: number; write_errors: number; last_error: string | null };
  admission: {
    active: Record<string, number>;
    waiting: number;
    rejections: Record<string, number>;
    predicted_tokens_per_s_at_1: number | null;
  };
}
/** GET /admin/v1/live: every live replica's state, merged (gateway/observability/live.py). */
export interface Live {
  replica: string;
  shared: boolean;
  degraded: boolean;
  window_s: number;
  replicas: { replica: string; running: number; waiting: number }[];
  running_total: number;
  waiting_total: number;
  users: { tenant: string; user: string | null; requests: number; tokens_per_s: number | null; sla_attainment: number | null }[];
  sla: { graded: number; met: number; attainment: number | null };
}
export interface List<T> {
  data: T[];
  since?: string;
  until?: string;
}
