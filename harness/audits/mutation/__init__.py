"""Mutation testing of real vendor kernels: does the harness catch a one-line bug in the kernel
that ships?

The torch catalogue (``harness.instruments.faults``) plants faults in a kernel of the project's own. This
package plants them in the vendor's source: ``python -m harness mutants --vendor triton`` copies
OpenAI's ``triton_kernels`` (found as the adapters find it: installed, vLLM's vendored copy, or the
ignored cache), applies one patch of ``patches.py`` to the copy, and runs the registry's adapters
of that vendor (``triton``, ``triton-unfused``) on the patched kernel in a fresh process, through
the usual checks (``engine.run_case``: bound, systematic test, peers' rules). The patches are data
(file, old line, new line), never patched source in git; the copy lives in a temporary folder.

A patch is *material* where the patched kernel's output differs from the unpatched kernel's on
some case (compared bit for bit, the same inputs) or where it raises: only then is there a bug to
catch. The matrix says, per patch: caught, MISSED (material and not caught), or no effect on the
cases run, with the peers' verdicts on the same runs beside ours. The unpatched kernel runs first
as the control; a FAIL there means the matrix cannot be read.
"""
