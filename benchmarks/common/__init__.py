"""What every study shares: settings, result containers and pages, ONNX sessions, latency, peers, our pipeline."""
