"""OpenAI-compatible HTTP layer: protocol (request/response models), router (routes),
openai_serving (engine glue), errors, admin (token-protected operator routes), app (create_app)."""
