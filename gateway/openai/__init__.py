"""The OpenAI surface: request schemas, translation to the runtime interface, response
formatters (JSON and SSE), logprobs, and the generation/response plumbing of a route."""
