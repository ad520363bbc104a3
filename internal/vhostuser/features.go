package vhostuser

import "fmt"

// Feature negotiation: the virtio feature bits (GET_FEATURES, SET_FEATURES)
// and the vhost-user protocol feature bits (GET_PROTOCOL_FEATURES,
// SET_PROTOCOL_FEATURES) the back end offers, and what acknowledging them
// does.

// Virtio feature bits.
const (
	featNotifyOnEmpty    = 1 << 24
	featLogAll           = 1 << 26 // VHOST_F_LOG_ALL: a migration's dirty logging (migration.go)
	featIndirectDesc     = 1 << 28
	featEventIdx         = 1 << 29
	featProtocolFeatures = 1 << 30 // VHOST_USER_F_PROTOCOL_FEATURES
	featVersion1         = 1 << 32
	featRingPacked       = 1 << 34 // VIRTIO_F_RING_PACKED
	featRingReset        = 1 << 40 // never offered: QEMU 7.2 mishandles it
)

// Protocol feature bits.
const (
	protoMQ                = 1 << 0
	protoLogShmFD          = 1 << 1
	protoReplyAck          = 1 << 3
	protoBackendReq        = 1 << 5
	protoConfig            = 1 << 9
	protoBackendSendFD     = 1 << 10
	protoInflightShmFD     = 1 << 12
	protoResetDevice       = 1 << 13
	protoConfigureMemSlots = 1 << 15
	protoStatus            = 1 << 16
	protoDeviceState       = 1 << 19
	protoShmem             = 1 << 22 // VHOST_USER_PROTOCOL_F_SHMEM: a shared-memory window (window.go)
)

// offer sets the features the back end offers for its configuration.
func (b *Backend) offer() {
	// Both ring layouts: the front end (QEMU's packed=on) decides.
	b.offered = featVersion1 | featIndirectDesc | featEventIdx | featRingPacked | featProtocolFeatures | featLogAll
	b.protoOffered = protoMQ | protoLogShmFD | protoReplyAck | protoBackendReq | protoBackendSendFD |
		protoResetDevice | protoConfigureMemSlots | protoStatus
	if b.cfg.Tag != "" {
		b.protoOffered |= protoConfig
	}
	switch {
	case b.cfg.CacheSize > 0:
		// A device with shared-memory regions cannot migrate (QEMU
		// blocks it): DEVICE_STATE is not offered beside a window.
		b.protoOffered |= protoShmem
	case b.cfg.State != nil:
		b.protoOffered |= protoDeviceState
	}
}

// acked decodes the bits a SET_FEATURES or SET_PROTOCOL_FEATURES
// acknowledges, every one of which must have been offered.
func acked(m *Message, offered uint64, what string) (uint64, error) {
	v, err := payloadU64(m)
	if extra := v &^ offered; err == nil && extra != 0 {
		err = fmt.Errorf("%s %#x were not offered", what, extra)
	}
	return v, err
}

// setFeatures applies SET_FEATURES. A ring that runs keeps the features it
// started with; VHOST_F_LOG_ALL, which arrives while rings run, starts or
// stops a migration's dirty logging at once.
func (b *Backend) setFeatures(m *Message) error {
	v, err := acked(m, b.offered, "features")
	if err != nil {
		return err
	}
	was := b.acked&featLogAll != 0
	b.acked = v
	b.setLogging(v&featLogAll != 0, was)
	return nil
}

// setProtocolFeatures applies SET_PROTOCOL_FEATURES. The FS_IO bounce
// needs the back-end channel, fds sent over it and its replies.
func (b *Backend) setProtocolFeatures(m *Message) error {
	v, err := acked(m, b.protoOffered, "protocol features")
	if err != nil {
		return err
	}
	b.proto = v
	const bounce = protoBackendReq | protoBackendSendFD | protoReplyAck
	b.channel.usable.Store(v&bounce == bounce)
	const shmem = protoShmem | protoBackendReq | protoReplyAck
	b.window.usable.Store(b.window.size > 0 && v&shmem == shmem)
	return nil
}
