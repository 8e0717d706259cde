"""Process and cgroup memory: readings (procmem, memory), leak growth and its classes, allocation
health, the peak breakdown, the UCX maps scan. A leaf: imports only moeguard_core (never api/,
engine/, model/, parallel/ or telemetry/)."""
