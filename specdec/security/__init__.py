"""Transport security and credentials: TLS settings and credentials
(`tls`), API keys of the front doors (`api_keys`), a throwaway local CA
(`local_ca`). Importing this package imports neither grpc nor cryptography;
each module imports what it needs."""
