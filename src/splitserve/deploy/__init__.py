"""Running an endpoint: local pods and a supervisor, Kubernetes manifests, an operator."""
