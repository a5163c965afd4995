"""Gated DeltaNet (GDN) linear attention: the gated delta rule and the causal conv1d before it.

Torch references::

    reference       chunk_gated_delta_rule (prefill), recurrent_gated_delta_rule(_with_gates)
                    (decode), gdn_gates
    conv1d          causal_conv1d_varlen (prefill), causal_conv1d_update (decode)

Faster versions of them::

    fla             chunk_gated_delta_rule through fla-core (CUDA images that have it);
                    chunk_indices builds its chunk indices on the device for CUDA graphs
    triton_decode   recurrent_gated_delta_rule(_with_gates)
    triton_gates    gdn_gates
    triton_conv1d   causal_conv1d_update

Importing this package imports no Triton code.
"""
