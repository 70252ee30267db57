"""Reports built from recorded results, never from memory: ``collect`` reads and reconciles the
result files of many jobs and machines; the sign-off report is built on it."""
