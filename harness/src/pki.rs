//! Certificates and keys for a test control plane: a CA, the API server's serving
//! certificate, client certificates (admin in `system:masters`, or any user and groups), and
//! the service account signing key.

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// A certificate and its key, PEM-encoded.
#[derive(Debug, Clone)]
pub struct Pem {
    /// The certificate.
    pub cert: String,
    /// The private key (PKCS#8).
    pub key: String,
}

/// The CA that signs everything else.
pub struct Ca {
    pem: Pem,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    /// A new self-signed CA.
    pub fn new() -> anyhow::Result<Self> {
        let key = KeyPair::generate().context("generating the CA key")?;
        let mut params = CertificateParams::new(Vec::<String>::new()).context("CA parameters")?;
        params.distinguished_name.push(DnType::CommonName, "ccm-e2e-ca");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let cert = params.self_signed(&key).context("self-signing the CA")?;
        let pem = Pem { cert: cert.pem(), key: key.serialize_pem() };
        Ok(Self { pem, issuer: Issuer::new(params, key) })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.pem.cert
    }

    /// A serving certificate for loopback and the given addresses (and the in-cluster names
    /// of the `kubernetes` Service, for pods that reach the API server through it).
    pub fn serving(&self, addresses: &[std::net::IpAddr]) -> anyhow::Result<Pem> {
        let key = KeyPair::generate()?;
        let names =
            ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"];
        let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
        params.subject_alt_names.push(SanType::IpAddress("127.0.0.1".parse()?));
        for address in addresses {
            params.subject_alt_names.push(SanType::IpAddress(*address));
        }
        params.distinguished_name.push(DnType::CommonName, "kube-apiserver");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Pem { cert: cert.pem(), key: key.serialize_pem() })
    }

    /// A client certificate for `user`, in `group` when given (the API server reads CN as
    /// the user name and O as the group; rcgen keeps one value per attribute).
    pub fn client(&self, user: &str, group: Option<&str>) -> anyhow::Result<Pem> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, user);
        if let Some(group) = group {
            params.distinguished_name.push(DnType::OrganizationName, group);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Pem { cert: cert.pem(), key: key.serialize_pem() })
    }
}

/// A fresh ECDSA key for signing service account tokens: (private key in PKCS#8 PEM,
/// public key in PEM).
pub fn service_account_key() -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate()?;
    Ok((key.serialize_pem(), key.public_key_pem()))
}
