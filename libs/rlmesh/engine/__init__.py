"""The embedded CPU engine: HF transformers causal LMs behind SGLang's native HTTP API, and the
client that drives either it or a real SGLang server."""
