//! Mutual TLS for cloudprovider.v1 over TCP, for a provider that runs outside the core's pod
//! (rustls, through tonic). Both sides present a certificate and check the other's against a
//! CA: the provider accepts only clients with a certificate of its CA, and the core connects
//! only to a provider whose certificate its CA signed for the name it dials. PEM files, as a
//! Kubernetes TLS Secret mounts them (`tls.crt`, `tls.key`, `ca.crt`); they are read at start.
//! A unix socket needs none of this: its file mode is its access control.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// The PEM files of one side of a mutual TLS connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This side's certificate chain.
    pub cert: PathBuf,
    /// This side's private key.
    pub key: PathBuf,
    /// The CA that signed the other side's certificate.
    pub ca: PathBuf,
}

/// A TLS file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {what} {path}: {error}")]
    Read {
        /// Which file (certificate, key, CA).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// A file holds no PEM block of the kind wanted.
    #[error("{what} {path} holds no PEM {kind}")]
    NotPem {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The PEM kind looked for.
        kind: &'static str,
    },
}

fn read(what: &'static str, path: &Path, kind: &'static str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|error| TlsError::Read { what, path: path.to_path_buf(), error })?;
    let text = String::from_utf8_lossy(&bytes);
    if !text.contains("-----BEGIN ") || !text.contains(kind) {
        return Err(TlsError::NotPem { what, path: path.to_path_buf(), kind });
    }
    Ok(bytes)
}

impl TlsFiles {
    /// The files `tls.crt`, `tls.key` and `ca.crt` of a directory (a mounted TLS Secret).
    pub fn in_dir(dir: &Path) -> Self {
        Self { cert: dir.join("tls.crt"), key: dir.join("tls.key"), ca: dir.join("ca.crt") }
    }

    fn identity(&self) -> Result<Identity, TlsError> {
        let cert = read("certificate", &self.cert, "CERTIFICATE")?;
        let key = read("private key", &self.key, "PRIVATE KEY")?;
        Ok(Identity::from_pem(cert, key))
    }

    fn ca(&self) -> Result<Certificate, TlsError> {
        Ok(Certificate::from_pem(read("CA certificate", &self.ca, "CERTIFICATE")?))
    }

    /// A provider's side: its certificate, and a client certificate of `ca` required.
    pub fn server_config(&self) -> Result<ServerTlsConfig, TlsError> {
        Ok(ServerTlsConfig::new().identity(self.identity()?).client_ca_root(self.ca()?))
    }

    /// The core's side: its client certificate, and a provider certificate of `ca` for
    /// `server_name` required.
    pub fn client_config(&self, server_name: &str) -> Result<ClientTlsConfig, TlsError> {
        Ok(ClientTlsConfig::new().identity(self.identity()?).ca_certificate(self.ca()?).domain_name(server_name))
    }
}
