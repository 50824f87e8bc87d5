"""The MCP tool loop the ingress runs for Anthropic's MCP connector and the Responses API's mcp tools."""
