"""The children the operator owns: builders (Deployment, Service, ConfigMap, ...), their apply
logic against the API server (children, kube) and apply errors. May import spec/ and moeguard_core;
never loop/ or diagnosis/."""
