//! Where a server listens: a unix socket (a stale one replaced, nothing else) or TCP; and the
//! signal that stops it.

use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::ServeError;

/// Where a server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A unix socket path ending in `.sock`.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

impl FromStr for Listen {
    type Err = ServeError;

    fn from_str(s: &str) -> std::result::Result<Self, ServeError> {
        let bad = |reason: &str| ServeError::Address { address: s.to_string(), reason: reason.to_string() };
        if let Some(path) = s.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(bad("a unix socket path must be absolute (unix:///path/provider.sock)"));
            }
            if !path.ends_with(".sock") {
                return Err(bad("a unix socket path must end in .sock"));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let hostport = s.strip_prefix("tcp://").or_else(|| s.strip_prefix("http://")).unwrap_or(s);
        hostport.parse().map(Self::Tcp).map_err(|_| bad("expected unix:///path.sock, tcp://host:port or http://host:port"))
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "unix://{}", p.display()),
            Self::Tcp(a) => write!(f, "http://{a}"),
        }
    }
}

/// Binds a unix socket: creates the parent directory, replaces a stale socket file (one no
/// server answers on), refuses to replace anything else, and sets `mode` on the socket.
pub fn bind_unix(path: &Path, mode: u32) -> std::result::Result<tokio::net::UnixListener, ServeError> {
    let err = |source| ServeError::Bind { path: path.display().to_string(), source };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(err)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    "another server is listening on this socket",
                )));
            }
            std::fs::remove_file(path).map_err(err)?;
        }
        Ok(_) => {
            return Err(err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, "path exists and is not a socket")));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    // Bound in a private directory (mode 0700) beside it, given its mode there and renamed into
    // place: the socket is never reachable at `path` with a wider mode than asked. (A path so
    // long that the staging one would pass the 107 bytes a socket address holds is bound in
    // place.)
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let staging = tempfile::Builder::new().prefix(".bind-").tempdir_in(parent).map_err(err)?;
    let staged = staging.path().join("s");
    let target = if staged.as_os_str().len() <= 107 { staged.as_path() } else { path };
    let listener = tokio::net::UnixListener::bind(target).map_err(err)?;
    std::fs::set_permissions(target, std::fs::Permissions::from_mode(mode)).map_err(err)?;
    if target != path {
        std::fs::rename(target, path).map_err(err)?;
    }
    Ok(listener)
}

/// Resolves when the process gets SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => std::future::pending::<()>().await,
    }
}
