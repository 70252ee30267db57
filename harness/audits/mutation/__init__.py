"""Mutation testing of real vendor kernels: does the harness catch a one-line bug in the kernel
that ships?

The torch catalogue (``harness.instruments.faults``) plants faults in a kernel of the project's own. This
package plants them in the vendor's source: ``python -m harness mutants --vendor triton`` copies
OpenAI's ``triton_kernels`` (found as the adapters find it: installed, vLLM's vendored copy, or the
ignored cache), applies one patch of ``patches.py`` to the copy, and runs the registry's adapters
of that vendor (``triton``, ``triton-unfused``) on the patched kernel in a fresh process, through
the usual checks (``engine.run_case``: bound, systematic test, peers' rules). The patches are data
(file, old line, new line), never patched source in git; the copy lives in a temporary folder.

A patch *changes* a case where the patched kernel's output differs from the unpatched kernel's
(compared bit for bit, the same inputs) or where it raises, and is *material* there where the
change alone, the patched output less the unpatched one, FAILs the same tests as an error would
(the bound, the projections, the energy): then the patched kernel's error is that change plus
honest rounding, and a catch is owed. A change that passes them alone is below what rounding can
show at the stated false-alarm rate. The matrix says, per patch: caught (every material case
FAILed or raised), MISSED (a material case passed), below noise (changes, none material), or no
effect on the cases run, with the peers' verdicts on the same runs beside ours. The unpatched kernel runs first
as the control; a FAIL there means the matrix cannot be read.
"""
