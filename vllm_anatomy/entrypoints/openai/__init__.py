"""The OpenAI-compatible server (mirrors vllm/entrypoints/openai/).

api_server.py (FastAPI app, routes), server_utils.py (errors, auth, body
limit), protocol.py / chat_protocol.py / completion_protocol.py (request and
response models), serving_chat.py / serving_completion.py (requests -> AsyncLLM
-> responses or SSE streams), serving_models.py (served names), cli_args.py.
"""
