"""What a rank trains with: the helpers a user's cell calls (offline models and data, LoRA models, FSDP,
checkpoints, the memory savers, the T4 profile) and the patches that make libraries behave in a rank. The public
ones keep their short paths (nbkit.offline, nbkit.savers, nbkit.fsdp, ...: see nbkit._MOVED).
"""
