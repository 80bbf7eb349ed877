"""The HTTP front process: the OpenAI API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`),
`/health` and `/metrics`, served by uvicorn, speaking to the coordinator's job front door as a client.

It never tokenizes and never loads MLX: a chat goes to the door as `messages` (the GPU worker renders
them with the tokenizer's chat template), a completion as `prompt`; stop strings are matched here, on
the generated text.
"""
