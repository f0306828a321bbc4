"""Serving glue: start and stop SGLang servers, the embedded CPU default (SmolLM2 + shipped
drafters), the demo, the HTTP client, the SGLang patch, the model cache."""
