"""The data plane: the Serve ingress (`ingress`) and the OpenAI-compatible HTTP layer it serves (`openai_api`,
its bodies `openai_schema`, its answers `responses`, its errors `errors`), the limits on callers (`rate_limit`),
one request's trip through a replica (`stream`), and the wire contract with the replicas (`protocol`).

Nothing here imports `deployments.replica`."""
