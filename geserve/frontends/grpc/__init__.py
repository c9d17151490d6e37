"""The KServe v2 / Triton gRPC frontend (inference.GRPCInferenceService and grpc.health.v1.Health) on grpc.aio."""
