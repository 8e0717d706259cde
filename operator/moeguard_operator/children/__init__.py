"""The children the operator owns: builders (Deployment, Service, ConfigMap, ...), their apply
logic against the API server (children, kube) and apply errors. May import spec/, constants,
loop.budget_document (the budget ConfigMap's content) and moeguard_core; never diagnosis/."""
