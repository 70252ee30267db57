"""What the harness takes from other projects, at run time and never into git: fetching vendor
code into the ignored cache (``fetch``), vLLM's own backend selection run under fake platforms
(``vllm_probe``), the project's replica of that selection (``selection``) and the check of one
against the other (``vllm_drift``), the project-owned build of FlashInfer's SM90 MoE subset
(``flashinfer_sm90``) and the one-line patches of vendor source used to mutate real kernels
(``patches``)."""
