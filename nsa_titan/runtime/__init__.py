"""What keeps a run honest while it runs: the step watchdog and heartbeat (`watchdog`), one rank's failure
told to the job (`failure`), whether a step's update is applied (`guard`: non-finite gradients, loss spikes),
graceful stop signals (`stop`), one run per output folder (`ownership`), fault injection for tests
(`fault_injection`) and what a run reports when something is off (`diagnostics`)."""
