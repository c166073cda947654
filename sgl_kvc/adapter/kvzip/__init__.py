"""KVzip's reconstruction pass, run by SGLang inside the scheduler (`reconstruction`), what its
forwards may read (`limits`), each request's plan (`planning`) and one forward (`forwards`)."""
