"""`doctor`: is a llama-server set up so that kvsidecar can help? `checks.Doctor` runs the checks of one
server into a `report.DoctorReport`."""
