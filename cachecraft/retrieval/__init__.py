"""cachecraft retrieval: documents, chunking, embeddings, the FAISS index and the persistent corpus."""
