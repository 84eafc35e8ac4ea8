raise ImportError("stand-in vllm: preflight must locate vllm, never import it")
