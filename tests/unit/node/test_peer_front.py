"""How the peer port's TLS front names a refused handshake (the ``reason`` label).

The integration tests (tests/integration/test_security.py) make real dials fail for
each reason a rogue broker can produce; this holds the rest of the table: the
OpenSSL verify codes and error reasons that map to each label.
"""

from __future__ import annotations

import ssl

import pytest

from geofed.node._tls_accept import refusal_reason


def _verify_error(code: int) -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, "certificate verify failed")
    exc.verify_code = code
    return exc


def _ssl_error(reason: str) -> ssl.SSLError:
    exc = ssl.SSLError(1, reason)
    exc.reason = reason
    return exc


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (_verify_error(10), "expired"),  # X509_V_ERR_CERT_HAS_EXPIRED
        (_verify_error(9), "expired"),  # not yet valid
        (_verify_error(20), "unknown_ca"),  # unable to get local issuer certificate
        (_verify_error(19), "unknown_ca"),  # self-signed certificate in the chain
        (_verify_error(18), "unknown_ca"),  # a self-signed leaf
        (_verify_error(26), "bad_certificate"),  # unsuitable purpose
        (_verify_error(7), "bad_certificate"),  # signature failure
        (_ssl_error("PEER_DID_NOT_RETURN_A_CERTIFICATE"), "no_certificate"),
        (_ssl_error("WRONG_VERSION_NUMBER"), "plaintext"),
        (_ssl_error("HTTP_REQUEST"), "plaintext"),
        (_ssl_error("TLSV1_ALERT_UNKNOWN_CA"), "handshake"),
        (_ssl_error("UNSUPPORTED_PROTOCOL"), "handshake"),
        (ConnectionAbortedError("SSL handshake is taking longer than 20 seconds"), "handshake"),
        (TimeoutError(), "handshake"),
    ],
)
def test_each_failed_handshake_gets_its_reason(exc: BaseException, reason: str) -> None:
    assert refusal_reason(exc) == reason
