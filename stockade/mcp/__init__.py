"""`stockade mcp`: the session API as an MCP server (stdio or streamable HTTP) for agent
frameworks, on the `mcp` package. `tools.py` holds what each tool does (on the SDK),
`server.py` the MCP wiring and transports, `cli.py` the command. See docs/mcp.md."""
