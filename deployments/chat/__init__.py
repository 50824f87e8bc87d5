"""Chat in and out of token ids, on the model replica: chat templates and tokenizing (prompts.py), the output
plan of a request (output_plan.py) and the tool-call and reasoning parsers (parsers/)."""
