"""The installed vLLM / vllm-omni, reached by feature detection: their entry points,
plugins, control plane, production's engine, and the plugin's own Omni CPU platform."""
