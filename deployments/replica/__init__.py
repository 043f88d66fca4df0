"""One LLM replica: the Serve deployment (`llm_deployment`) over `LLMServer` (`llm_server`) and its parts:
which adapters it offers (`adapters`), prompts and sampling per choice (`prompts`), the change feed and the
placement plan (`sync`), what it reports (`report`), the resources it asks Ray for (`resources`).

It imports the data plane's wire contract (`deployments.data_plane.protocol`) and nothing else of it."""
