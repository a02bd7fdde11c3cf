"""The official client's TLS settings, rebuilt for a connection of our own, and what says the
files they are read from changed.

Place in the flow: keepalive.py's :class:`~dra_driver.kube.keepalive.KeepAliveGetter` connects
to the API server with the TLS settings the official client would use, taken from its
``kubernetes.client.Configuration`` by :meth:`TlsSource.for_configuration`; the getter decides
when to look at the files again and what to do with its connections when they changed.

The settings (as ``kubernetes.client.rest`` builds them for urllib3): the CA file or data (the
certifi bundle when neither is given), the client certificate, ``verify_ssl``, and hostname
checks, off only for ``assert_hostname=False``. The files: ``ssl_ca_cert`` (the in-cluster
ServiceAccount's ``ca.crt`` in a Pod, or a kubeconfig's ``certificate-authority``), and
``cert_file`` and ``key_file``, the client certificate; their paths are read from the
configuration each time, since a kubeconfig's refresh hook may set new ones. A file counts as
changed when its path, device, inode (a Secret volume update swaps a symlink), size or
modification time did. Certificate data given inline (``ca_cert_data``) cannot change.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import certifi

FileState = tuple[str, int, int, int, int]
"""Path, device, inode, size and modification time (ns) of a file; -1s when it cannot be
looked at."""


@dataclass(frozen=True)
class TlsSource:
    """Where a getter's TLS settings come from. ``context()`` builds them from the files (and
    data) they name; ``files()`` names those files as of now (the paths may change too: a
    kubeconfig's refresh hook sets them again). A getter builds a new context, and drops its
    idle connections, when a file named changes."""

    context: Callable[[], ssl.SSLContext]
    files: Callable[[], tuple[str, ...]] = tuple

    @classmethod
    def for_configuration(cls, configuration: Any) -> TlsSource:
        """The TLS settings of a ``kubernetes.client.Configuration``, read from it (and the
        files it names) whenever they are built."""
        return cls(
            context=lambda: _tls_context(configuration),
            files=lambda: _tls_files(configuration),
        )


def files_state(paths: tuple[str, ...]) -> tuple[FileState, ...]:
    """What says a file changed: path, device, inode (a Secret volume swaps a symlink to a new
    file), size and modification time; -1s for a file that cannot be looked at."""
    states = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            states.append((path, -1, -1, -1, -1))
        else:
            states.append((path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(states)


def _tls_files(configuration: Any) -> tuple[str, ...]:
    """The files the TLS settings of a configuration are read from: the CA file
    (``ssl_ca_cert``: a kubeconfig's ``certificate-authority``, or the in-cluster
    ServiceAccount's ``ca.crt``), the client certificate and its key."""
    paths = (configuration.ssl_ca_cert, configuration.cert_file, configuration.key_file)
    return tuple(str(p) for p in paths if p)


def _tls_context(configuration: Any) -> ssl.SSLContext:
    """TLS settings of the official client (kubernetes.client.rest builds the same ones for
    urllib3): trust only the CA file or data given (the certifi bundle when neither is), client
    certificate, ``verify_ssl``, hostname checks off only for ``assert_hostname=False``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies certificate and hostname
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # as urllib3
    if configuration.verify_ssl:
        if configuration.ssl_ca_cert or configuration.ca_cert_data:
            if configuration.ssl_ca_cert:
                context.load_verify_locations(cafile=configuration.ssl_ca_cert)
            if configuration.ca_cert_data:
                context.load_verify_locations(cadata=configuration.ca_cert_data)
        else:
            context.load_verify_locations(cafile=certifi.where())
        context.check_hostname = configuration.assert_hostname is not False
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return context
