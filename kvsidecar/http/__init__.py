"""The HTTP machinery every listener shares: the route table (a leaf), guards, the dispatcher, the
listener's per-connection limits and the OpenAPI document."""
