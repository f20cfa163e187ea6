"""The proxy that speaks llama-server's own API (OpenAI, Anthropic, Responses routes): sessions told
apart, pinned to a slot through the coordinator, forwarded with its own HTTP/1.1 client."""
