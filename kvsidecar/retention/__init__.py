"""Retention (spec §43): what snapshot files to delete and why (`plan`, pure), and the job that applies it
(`job`)."""
