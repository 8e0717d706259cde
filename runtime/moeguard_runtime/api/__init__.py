"""The HTTP face: the FastAPI server, the OpenAI request/response schema, tokenizers, detokenizing,
chat templates. May import engine/, model/, telemetry/, memory/ and moeguard_core; nothing below it
imports api/ (model/ and memory/ never do)."""
