"""The data plane: the Serve ingress (`ingress`) and the OpenAI-compatible HTTP app it serves (`openai_api`): the
front door that knows the caller before the body (`front_door`), the routes as one class (`openai_routes`) over
their bodies (`openai_schema`), answers (`responses`) and errors (`errors`); the limits on callers (`rate_limit`);
one request's trip through the replicas (`replica_session`), what it tells /metrics (`stream_metrics`) and how it
is rendered (`renderers`); and the wire contract with the replicas (`protocol`).

Nothing here imports `deployments.replica`."""
