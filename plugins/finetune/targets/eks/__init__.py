"""The `eks` target as a package of parts, each owning one thing:

- `target`: `EksTarget`, the thin class the DAG's stages call;
- `nodegroup`: the EKS node group (scaling, instance type, usable nodes, scale-in protection);
- `reservations`: concurrent runs' node reservations on one node group;
- `image_build`: the trainer image (ECR, BuildKit Job, CodeBuild);
- `rendezvous`: the run's etcd keys (service proxy) or an etcd restart;
- `job`: the run's PyTorchJob from creation to its end;
- `manifests`: the Kubernetes objects the run creates (pure);
- `triggers`: the deferrable waits;
- `clients`: boto3, kubernetes and kubernetes_asyncio clients, and transient-error retries.
"""
