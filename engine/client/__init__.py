"""Engine clients: how an asyncio caller submits requests to one engine and streams their outputs.

`interface.py` holds the interface (EngineClientBase) both clients implement; `thread_client.py` steps the
engine on a thread of this process, `process_client.py` in a child process (`engine_process.py`), with every
message they exchange in `messages.py`. The serving path always uses the process client.
"""
