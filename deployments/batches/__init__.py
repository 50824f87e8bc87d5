"""OpenAI's Files API for batch jobs (files.py: the store; the ingress's file_routes.py serves it). The Batches API
that runs them is issue 58's next step."""
