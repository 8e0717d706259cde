"""Disaggregated prefill and decode (issue 33): a prefill worker runs the prompt and offers its KV cache, a
decode worker reads it over UCX (NIXL) and continues the generation. May import model/, engine/ (types),
memory/ and moeguard_core; model/ and memory/ never import it."""
