"""Session state off the GPU: host pinned-memory tier, disk tier (safetensors), and the index.

Role: store and find spilled session segments (KV pages of the full-attention layers plus the GDN
head checkpoint). A leaf package: it imports nothing of ours.
"""
