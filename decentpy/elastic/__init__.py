"""Elastic gossip: training that survives a dead peer (docs/elastic.md).

- :mod:`.rendezvous` -- the one process that must stay up: a c10d ``TCPStore`` host
  (``python -m decentpy.rendezvous``) and :func:`connect`;
- :mod:`.etcd` -- the same membership in an etcd cluster (:func:`~decentpy.elastic.etcd.connect_etcd`),
  where no single host may be trusted to stay up, on etcd's v2 API (imported on demand: it needs
  ``python-etcd``); :mod:`.etcd_v3` -- the same on the v3 API through etcd's HTTP/JSON gateway (no
  client library; etcd 3.6 has no v2 API): :func:`~decentpy.elastic.etcd_v3.connect_etcd_v3`;
- :mod:`.membership` -- member ids, heartbeats, and the agreement on each epoch's member list;
- :mod:`.auth` -- admission by a job secret: signed membership records, the job's namespace, the
  handshake of every membership's process group (docs/security.md);
- the gossip step that finishes locally when a peer fails is the elastic failure policy of every
  gossip strategy (:class:`decentpy.engine.failure.ElasticPolicy`);
- :mod:`.wrapper` -- :class:`ElasticGossip`, one ``DecentralizedDataParallel`` per membership epoch.
"""

from .membership import AdmissionError, EvictedError, Formation, JoinRefusedError, Membership, RendezvousError
from .rendezvous import connect, serve
from .wrapper import ElasticGossip, MembershipChange

__all__ = ["ElasticGossip", "MembershipChange", "Membership", "Formation", "RendezvousError", "EvictedError",
           "AdmissionError", "JoinRefusedError", "connect", "serve"]
