"""The `eks` target as a package of parts, each owning one thing:

- `target`: `EksTarget`, the thin class the DAG's stages call: each stage's story, the work
  in the parts below;
- `checks`: what validate refuses for the eks fields;
- `nodegroup`: the EKS node group (scaling, the run's nodes reserved and given back, instance
  type, usable nodes, scale-in protection);
- `reservations`: concurrent runs' node reservations on one node group;
- `node_health`: the preflight's verdict, XID errors, bad nodes cordoned and replaced;
- `image_build`: the trainer image (ECR, BuildKit Job, CodeBuild; `buildah` where Airflow
  runs, `registry` what the builders share);
- `prepare_pod`: the prepare_data pod (prepare_on pod), a batch Job;
- `rendezvous`: the run's etcd keys (service proxy) or an etcd restart;
- `launchers`: PyTorchJob or TrainJob, the one place that knows which runs the trainer;
- `job`: the run's job from creation to its end;
- `evaluation_job`: trainer.evaluate in a job of its own;
- `manifests`: the Kubernetes objects the run creates (pure);
- `triggers`: the deferrable waits, one polling loop;
- `clients`: boto3, kubernetes and kubernetes_asyncio clients, and transient-error retries.
"""
