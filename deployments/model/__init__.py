"""The model replica side: the Serve deployment of one model and the service that owns its engine client."""
