"""Model-level checks: GPT-OSS checkpoints whose MoE layers run through any registry backend.

``checkpoint`` reads (and writes) GPT-OSS's real checkpoint format lazily, one layer at a time;
``model`` builds transformers' ``GptOssForCausalLM`` with every MLP replaced by a module that hands
the layer's inputs and MXFP4 weights to a backend (the same adapters the sweep uses);
``layercheck`` judges each layer's output on the model's own activations against the oracle and
its per-element bound, and compares whole models (KL divergence, top-1 agreement); ``task`` is the
synthetic GPQA-format task and ``tiny`` the script that trains the committed tiny fixture on it.
"""
