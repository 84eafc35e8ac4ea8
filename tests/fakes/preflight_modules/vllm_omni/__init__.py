raise ImportError("stand-in vllm_omni: preflight must locate vllm_omni, never import it")
