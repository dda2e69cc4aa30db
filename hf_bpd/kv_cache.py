"""The KV cache's name in model inputs and outputs.

transformers 5.24 renamed `past_key_values` to `cache` (the old name still works there, with a deprecation warning);
hf_bpd passes and reads the cache under the installed version's name. The Hub remote code inlines this module into
its copy of `heads.py` (`hf_bpd.hub.remote_code.heads_source`), so it imports transformers only.
"""

from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
