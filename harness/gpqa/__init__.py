"""GPQA for GPT-OSS with lm-eval: does the model still score with this backend's MoE?

``data`` reads a GPQA CSV into lm-eval documents with OpenAI's choice permutations, the two prompt
forms and gpt-oss's answer extraction; ``tasks/`` holds the project's lm-eval task YAMLs (main,
diamond, extended; log-likelihood and chain-of-thought); ``lm`` the two lm-eval models (GPT-OSS in
this process through any registry backend, and a strict OpenAI-compatible chat client);
``server`` checks or starts the server; ``stats`` the intervals, the paired test and the verdict
rule; ``run`` one backend's run and its files; ``cli`` the ``gpqa`` subcommand.
"""
