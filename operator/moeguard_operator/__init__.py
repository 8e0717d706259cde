"""moeguard's kopf operator for ``MoEInferenceService`` (moeguard.dev/v1alpha1)."""
