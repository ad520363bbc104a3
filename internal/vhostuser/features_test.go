package vhostuser

import (
	"io"
	"log/slog"
	"testing"
)

// TestProtocolFeaturesNotOffered: QEMU 11.1 knows protocol feature bits 20
// (GET_VRING_BASE_INFLIGHT) and 21 (GPA_ADDRESSES); the back end implements
// neither, so no configuration may offer them (DESIGN.md §12). Bit 22 and
// above are for other work and are checked only for being unknown here.
func TestProtocolFeaturesNotOffered(t *testing.T) {
	const (
		protoGetVringBaseInflight = 1 << 20
		protoGPAAddresses         = 1 << 21
	)
	known := uint64(protoMQ | protoLogShmFD | protoReplyAck | protoBackendReq | protoConfig |
		protoBackendSendFD | protoInflightShmFD | protoResetDevice | protoConfigureMemSlots |
		protoStatus | protoDeviceState)
	for _, cfg := range []Config{
		{RequestQueues: 1},
		{RequestQueues: 2, Tag: "myfs"},
		{RequestQueues: 1, Tag: "myfs", State: &fakeState{}, Workers: 2, Metrics: true},
	} {
		cfg.Handler = HandlerFunc(func(int) RequestHandler { return echoHandler{} })
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
		b, err := NewBackend(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if b.protoOffered&(protoGetVringBaseInflight|protoGPAAddresses) != 0 {
			t.Errorf("tag %q state %v: protocol features %#x offer bit 20 or 21", cfg.Tag, cfg.State != nil, b.protoOffered)
		}
		if extra := b.protoOffered &^ known; extra != 0 {
			t.Errorf("tag %q state %v: protocol features %#x offer unknown bits %#x", cfg.Tag, cfg.State != nil, b.protoOffered, extra)
		}
		if cfg.State != nil && b.protoOffered&protoDeviceState == 0 {
			t.Errorf("with a device state: DEVICE_STATE not offered (%#x)", b.protoOffered)
		}
	}
}
