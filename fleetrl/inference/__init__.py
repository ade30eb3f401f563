"""The inference server's library side: `membership`, how a replica that joins by itself stays a member of its
run's controller. The engines and the gRPC/HTTP edges are services/inference."""
